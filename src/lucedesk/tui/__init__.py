"""The lucedesk terminal UI (Textual)."""
