"""trainflow's stages of the config's `stages` list (conf/stages/*.yaml): early stopping and an exponential moving
average of the weights. They use only the stage interface (trainflow.loop.stages), as a project's own stage does."""
