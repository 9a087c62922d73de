"""Offline batch jobs over JSONL files (`python -m engine.batch`): formats, files, and the loop."""
