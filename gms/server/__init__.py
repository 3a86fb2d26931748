"""The Trio server: a thin shell around gms.fsm and gms.store."""

from .config import ServerConfig
from .core import ServiceCore
from .server import Server, SocketPathError, run_server

__all__ = ["Server", "ServerConfig", "ServiceCore", "SocketPathError", "run_server"]
