"""draftsmith.controllers"""
