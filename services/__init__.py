"""gRPC services of the Kervan mesh."""
