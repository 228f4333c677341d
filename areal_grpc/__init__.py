"""areal-grpc core library: contract helpers shared by every service (no service code here)."""

__version__ = "0.1.0"
