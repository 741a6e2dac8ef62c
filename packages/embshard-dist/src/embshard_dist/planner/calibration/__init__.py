"""Calibration: measure this machine's kernel, memory and collective speeds into a topology."""
