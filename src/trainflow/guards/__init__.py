"""The stages that watch a run for what goes wrong: `watchdog` (a rank that hangs), `stragglers` (a rank the others
wait for), `parity` (a parallel run checked against one process), `nonfinite` (a non-finite loss or gradient norm)
and `fault_tolerance` (torchft replica groups that train on through a lost one)."""
