"""modeltools"""
