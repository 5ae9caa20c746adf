"""The plan file: its format (pydantic models), reading it safely, diagnostics, rule matching."""
