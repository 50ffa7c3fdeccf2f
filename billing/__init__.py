"""Usage ledger, price book, invoices and Prometheus meters."""
