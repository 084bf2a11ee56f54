"""The GPU jobs: training and evaluation drivers, their metrics log and plots."""
