"""Preference pairs (chosen vs rejected) to a shard dataset: `tokenize --format preference`."""

from segpack.text.chat.preference.pairs import Pair, PairFormatError, parse_pair, read_pairs

__all__ = ["Pair", "PairFormatError", "parse_pair", "read_pairs"]
