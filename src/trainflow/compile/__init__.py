"""torch.compile on purpose: `compiler` (the compile stage: scope, options, the warm-up left out of the figures, the
compiled-vs-eager check and the report) and `diagnostics` (graph breaks and recompiles in words a user can act on)."""
