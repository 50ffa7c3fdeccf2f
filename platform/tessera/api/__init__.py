"""The gateway's HTTP routers, request schemas, auth dependency and error handling."""
