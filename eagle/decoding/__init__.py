"""Decoding algorithms: the decode loop, draft trees and masks, acceptance, sampling, proposers, tree sizing."""
