"""What every part of a run uses: `files` (writing a file whole), `locks` (one run at a time in a folder), `rundir`
(one run directory for all ranks), `failures` (a failed rank's record, and the one error made of every rank's),
`rank` (this process's rank, as its launcher set it), `targets` (a user's
`_target_`), `optional` (the extras), `device` (the device's arithmetic and syncs), `seeding`, `tolerance` (how much
difference each correctness check accepts) and `console` (the progress line and train.log)."""
