"""What an operator writes and reads: the tenant policy file (``policy``), the rows of
``gms status`` (``status``), saved logs replayed offline (``postmortem``), and one
server per device under ``gms serve --devices`` (``supervisor``)."""
