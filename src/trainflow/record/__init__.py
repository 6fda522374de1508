"""What a run writes: `fingerprint` and `cost` (the stages that record what decides a run's speed, and its energy
and money), `summary_file` (summary.json's format), `ledger` (a line per run), `kept` (what a run may do in a
folder that holds an earlier run's results), `sweeps` (a -m sweep's folder, its finished jobs skipped and the
others resumed) and `sweep_outcome` (a job's failure and returned value; torch-free, as the launchers use it for the
jobs of any Hydra app). The offline tools that read them are trainflow.report."""
