"""What this node holds and does with it: the hot dir, the pushes of what training saves,
prefetches into it, standby copies, and the retention of the hot dir and the tiers."""
