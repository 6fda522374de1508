"""Many runs side by side: `sweeps` (a -m sweep's folder, its finished jobs skipped and the others resumed), `runs`
(the report of the runs under a folder), `render` (its pages: report.md, report.png) and `ladder` (the workflow
ladder's rungs and gates)."""
