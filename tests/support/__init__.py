"""What tests share: the recording mock engine, loopback stand-ins, fake ssh, configs, the whole-graph fixtures."""
