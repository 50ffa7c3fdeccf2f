"""Tessera's control plane: settings, CLI, gateway, tenants, quotas, deployments."""
