"""The offline tools that read what runs wrote (trainflow.record): `sweeps` (a -m sweep's folder, its finished jobs
skipped and the others resumed), `runs` (the report of the runs under a folder), `render` (its pages: report.md,
report.png), `ladder` (the workflow ladder's rungs and gates), `ledger_list` (`trainflow ledger`) and `trainflow
compare` (`sides`, `compare`, `causes`, `gates`, `checkpoints`, `bisect`, `render_compare`)."""
