"""Layers of the dsv41-exl3 deployment: one module per ComponentResource, pure logic beside them."""
