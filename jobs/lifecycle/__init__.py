"""A job's life in the launcher: preflight, claim, pipeline run, export, finish; the queue."""
