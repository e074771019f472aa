"""What a job measured and cost: accounting, hardware, prices, reports."""
