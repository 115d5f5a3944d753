"""What every Kervan service shares: server bootstrap, error mapping, protobuf conversion."""
