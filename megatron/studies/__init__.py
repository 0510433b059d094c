"""Studies and measurements that tools/ run (delay, memory, calibration); not imported by training."""
