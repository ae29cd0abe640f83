"""Rank analysis: K/V captured per agent with the LoRA split (`kv_capture`), effective ranks and cross-agent
similarity with the papers' rank claims (`analysis`), and the analysis of a trace file (`trace_analysis`)."""
