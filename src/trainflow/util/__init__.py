"""What every part of a run uses: `files` (writing a file whole), `locks` (one run at a time in a folder), `rundir`
(one run directory for all ranks), `device` (the device's arithmetic and syncs), `seeding`, `tolerance` (how much
difference each correctness check accepts) and `console` (the progress line and train.log)."""
