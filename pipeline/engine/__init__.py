"""Scheduling and KV block bookkeeping. Pure Python: nothing here imports torch."""
