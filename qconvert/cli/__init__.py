"""The command line: the click group and each command's options and output (main.py), the console's progress
(console.py), the console script (entry.py) and the JAX platform check. Kept empty so that entry.py can install
the signal handlers before click and JAX are imported."""
