"""Sending the load: one request timed chunk by chunk (request), one process's dispatch loop (dispatch)."""
