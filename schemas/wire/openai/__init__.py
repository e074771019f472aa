"""OpenAI's Batch API wire format: request lines in (`request.py`), response and error lines
out (`response.py`), and its Batch and File objects (`objects.py`)."""
