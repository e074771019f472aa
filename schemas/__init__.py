"""What every process shares: the job spec, the records, the tables and the storage interface."""
