"""Anthropic's Message Batches wire format: a request line in (`request.py`: `{custom_id,
params}`, params a Messages request, into the same row the OpenAI chat path makes), a result
line out (`results.py`: succeeded, errored, canceled, expired), and its MessageBatch object,
lists and error shape (`objects.py`)."""
