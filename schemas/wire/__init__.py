"""The batch wire formats: what a client's batch input file and its result files hold, and the
API objects that describe them.  One package per format (`openai/`, `anthropic/`: Anthropic's
Message Batches); what any batch format needs (a line index, byte ranges, custom ids, a line's
error) is `lines.py`, and a line of either format is read through `formats.py`.  Pure data: no
Beam, HTTP client or engine."""
