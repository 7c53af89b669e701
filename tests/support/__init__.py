"""Helpers shared by the tests (no tests here): oracles, small corpora, tiny models, configs."""
