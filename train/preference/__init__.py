"""Preference training (DPO, IPO, SimPO, ORPO) on packed pair rows (docs/preference.md)."""
