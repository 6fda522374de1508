"""A user's own project trained by trainflow: a model, a dataset factory and a task, found by `_target_` alone."""
