"""Benchmarks: ``skippyd bench`` load generation and reports, and the scheduler lab.

The lab replays the pure policy on a virtual clock; ``runtime`` times llama.cpp alone.
Tools only: the serving code never imports from here.
"""
