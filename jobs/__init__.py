"""The launcher's side: the CLI, the job lifecycle, metrics and reports, model tools."""
