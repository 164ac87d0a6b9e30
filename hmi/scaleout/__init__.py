"""Scale-out: HMI replicas on Ray Serve (hmi.scaleout.ray_serve)."""
