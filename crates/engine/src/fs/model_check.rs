//! What the shuttle models share (`handle_model`, `dio_model`, `zeroing_model`,
//! `group_commit`'s and `grace.rs`'s models): a broken variant must be caught.

/// Run `check` (shuttle's schedules of the broken variant `what`): it must fail, with a
/// message containing `expect`.
pub(crate) fn expect_caught(what: &dyn std::fmt::Debug, expect: &str, check: impl FnOnce()) {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(check));
    let err = r.expect_err("the broken variant passed every schedule");
    let msg = err
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default();
    assert!(msg.contains(expect), "{what:?}: {msg}");
}
