"""`tokenmill serve`: the OpenAI Batch API (`/v1/files`, `/v1/batches`) over warm engines
(docs/SERVING.md).  A batch is a tokenmill job of the same id, run by the job lifecycle the
CLI runs (`runner.run_job`) in one engine process per configured model, which keeps its
engine loaded between batches."""
