"""The batch wire formats: what a client's batch input file and its result files hold, and the
API objects that describe them.  One package per format (`openai/`; the next, Anthropic's
Message Batches, is a package beside it); what any batch format needs (a line index, byte
ranges, custom ids, a line's error) is `lines.py`.  Pure data: no Beam, HTTP client or engine."""
