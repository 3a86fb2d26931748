"""Restart and take-over: a server that comes back, or hands over, with every layout.

The keeper link (``mirror``: every event and fd to the keeper, and what it
hands back), a node rebuilt from a journal or an image (``resume``), the live
take-over between two servers (``takeover``), what a starting server does
first (``startup``) and how it takes the node and carries on its predecessor's
clients (``succession``).  Imports ``service``, ``tiers`` and ``edge``.
"""
