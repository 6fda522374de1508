"""The run's configuration: `schema` (the typed sections Hydra checks every composed run against; every default lives
there), `checks` (the value checks a type cannot express, run once before any work), `sections` (the model, data and
task sections: a built-in option's keys or a user's `_target_`'s) and `targets` (importing and calling a user's
`_target_`, its failures one line)."""
