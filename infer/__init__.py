"""Inference entry points: the ``eagle-generate`` command line and the ``eagle-bench`` benchmark."""
