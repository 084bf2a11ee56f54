"""The GPU job drivers: training and evaluation (CPU checks, then the step loop on the workers), their metrics log
and plots."""
