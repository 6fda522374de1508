"""The offline tools that read what runs wrote (trainflow.record): `runs` (the report of the runs under a folder,
a sweep's report), `render` (its pages: report.md, report.png), `ladder` (the workflow ladder's resolvers and
gates), `ledger_list` (`trainflow ledger`) and `trainflow compare` (`sides`, `compare`, `causes`, `gates`,
`checkpoints`, `bisect`, `render_compare`)."""
