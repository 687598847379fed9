"""Training and calibration of exits: optax training of exit modules, Learn-then-Test thresholds."""
