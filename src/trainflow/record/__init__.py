"""What a run writes: `fingerprint` and `cost` (the stages that record what decides a run's speed, and its energy
and money), `summary_file` (summary.json's format), `ledger` (a line per run) and `kept` (what a run may do in a
folder that holds an earlier run's results). The offline tools that read them are trainflow.report."""
