"""One process, no launch: each module's values, fast."""
