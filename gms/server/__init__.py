"""The Trio server: a thin shell around gms.fsm and gms.store."""

from ..system.paths import SocketPathError
from .config import ServerConfig
from .server import Server, run_server
from .service.core import ServiceCore

__all__ = ["Server", "ServerConfig", "ServiceCore", "SocketPathError", "run_server"]
