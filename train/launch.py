"""``eagle-train``: run ``train/main.py`` through the ``deepspeed`` launcher.

Every argument is passed on: launcher options first (``--num_gpus``, ``--num_nodes``,
``--hostfile``, ...) then ``--`` and the trainer's (``--config``, ``--set``, ``--report-to``).
Without ``--``, all arguments go to the trainer."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher, trainer = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    beside = Path(sys.executable).with_name("deepspeed")
    exe = str(beside) if beside.is_file() else shutil.which("deepspeed")
    if exe is None:
        print("eagle-train: error: the deepspeed launcher is not installed: pip install deepspeed", file=sys.stderr)
        return 2
    script = str(Path(__file__).with_name("main.py"))
    os.execv(exe, [exe, *launcher, script, *trainer])
    return 0


if __name__ == "__main__":
    sys.exit(main())
